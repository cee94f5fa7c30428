// CPU backend of the internode protocol (internode_cpu.cpp): the kernels' role code
// (internode_roles.cuh, internode_fused_roles.cuh) on threads over host-memory buffers, "put
// with signal" being a memcpy into the peer's buffer and a release store of the signal.
// Synchronous: returns when every launched rank is done or gave up after a timeout (recorded
// in common.error).
#pragma once

#include "kernels/internode.cuh"
#include "kernels/intranode_cpu.h"

namespace moe_dispatch {
namespace internode {

using intranode::CpuOptions;

// The staged pipeline's stage 1.
void run_node_notify_cpu(const NotifyArgs& args);
void run_node_dispatch_cpu(const DispatchArgs& args, const CpuOptions& options);
void run_node_combine_cpu(const CombineArgs& args, intranode::DType dtype, const CpuOptions& options);

// The fused pipeline.
void run_fused_notify_cpu(const FusedNotifyArgs& args);
void run_fused_dispatch_cpu(const FusedDispatchArgs& args, const CpuOptions& options);
void run_fused_combine_cpu(const FusedCombineArgs& args, intranode::DType dtype, const CpuOptions& options);

}  // namespace internode
}  // namespace moe_dispatch

// Host entry points of the internode kernels (internode.cuh: protocol and layout). Each checks
// its arguments (std::invalid_argument naming the value) and launches asynchronously on
// `stream`: no host synchronisation, CUDA-graph capturable.
#pragma once

#include <cuda_runtime.h>

#include "kernels/internode.cuh"

namespace moe_dispatch {
namespace internode {

// kLoopback: every rank's buffer is in this process (Common::buffers), a put is a warp copy
// plus a release store; kNvshmem: Common::symmetric is this PE's nvshmem_malloc'ed buffer, a
// put is nvshmemx_putmem_signal_nbi_warp to the PE (global rank) of the same local index.
enum Mode : int32_t { kLoopback = 0, kNvshmem = 1 };

// Checks the fields every launch shares; `fused` also checks the NVLink buffers.
void check_common(const Common& common, Mode mode, bool fused);

// True when the extension was compiled with NVSHMEM (kNvshmem launches possible).
bool nvshmem_compiled();

// ---- staged pipeline, stage 1 ----
// One block per launched rank (kNotifyThreads threads). Collective along each rail.
void launch_node_notify(const NotifyArgs& args, Mode mode, bool cooperative, cudaStream_t stream);
// 2 * num_channels blocks per launched rank (senders even, receivers odd).
void launch_node_dispatch(const DispatchArgs& args, Mode mode, bool cooperative, cudaStream_t stream);
// 2 * num_channels blocks per launched rank; `dtype` is y's element type.
void launch_node_combine(const CombineArgs& args, intranode::DType dtype, Mode mode, bool cooperative,
                         cudaStream_t stream);

// ---- fused pipeline ----
// One block per launched rank: counts along the rail, then relayed over NVLink (collective over
// every rank's rail and node).
void launch_fused_notify(const FusedNotifyArgs& args, Mode mode, bool cooperative, cudaStream_t stream);
// 3 * num_channels blocks per launched rank: RDMA senders, forwarders, NVLink receivers.
void launch_fused_dispatch(const FusedDispatchArgs& args, Mode mode, bool cooperative, cudaStream_t stream);
// 3 * num_channels blocks per launched rank: holder senders, forwarder reducers, source reducers.
void launch_fused_combine(const FusedCombineArgs& args, intranode::DType dtype, Mode mode, bool cooperative,
                          cudaStream_t stream);

}  // namespace internode
}  // namespace moe_dispatch

// Host entry points of stage 1 of the internode kernels (internode.cuh: protocol and layout).
// Each checks its arguments (std::invalid_argument naming the value) and launches
// asynchronously on `stream`.
#pragma once

#include <cuda_runtime.h>

#include "kernels/internode.cuh"

namespace moe_dispatch {
namespace internode {

// kLoopback: every rank's buffer is in this process (Common::buffers), a put is a warp copy
// plus a release store; kNvshmem: Common::symmetric is this PE's nvshmem_malloc'ed buffer, a
// put is nvshmemx_putmem_signal_nbi_warp to the PE (global rank) of the same local index.
enum Mode : int32_t { kLoopback = 0, kNvshmem = 1 };

// Checks the fields every launch shares; `cpu` relaxes nothing but the mode.
void check_common(const Common& common, Mode mode);

// True when the extension was compiled with NVSHMEM (kNvshmem launches possible).
bool nvshmem_compiled();

// One block per launched rank (kNotifyThreads threads). Collective along each rail.
void launch_node_notify(const NotifyArgs& args, Mode mode, bool cooperative, cudaStream_t stream);

// 2 * num_channels blocks per launched rank (senders even, receivers odd).
void launch_node_dispatch(const DispatchArgs& args, Mode mode, bool cooperative, cudaStream_t stream);

// 2 * num_channels blocks per launched rank; `dtype` is y's element type.
void launch_node_combine(const CombineArgs& args, intranode::DType dtype, Mode mode, bool cooperative,
                         cudaStream_t stream);

}  // namespace internode
}  // namespace moe_dispatch

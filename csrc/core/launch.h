// Typed kernel launch: arguments are checked against the kernel's parameter types by the
// compiler (cudaLaunchKernelEx's variadic form), never packed by hand into a void* array.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <utility>

#include "core/error.h"

namespace moe_dispatch {

// Most blocks of `kernel` (with `threads` threads, `smem_bytes` dynamic shared memory) that the
// current device keeps resident at once.
template <typename Kernel>
int max_resident_blocks(Kernel kernel, int threads, size_t smem_bytes = 0) {
  int device = 0, num_sms = 0, per_sm = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes));
  return per_sm * num_sms;
}

// Lets `kernel` use `bytes` of dynamic shared memory (above the default 48 KB the runtime needs
// to be told); returns `bytes`.
template <typename Kernel>
size_t prepare_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes > 0)
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return bytes;
}

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...). `cooperative` asks the
// runtime to guarantee that every block is resident at once (blocks of one launch wait on
// each other), failing the launch otherwise.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                   bool cooperative, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative;
  attribute[0].val.cooperative = cooperative ? 1 : 0;
  config.attrs = attribute;
  config.numAttrs = 1;
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// launch_kernel after checking that every block of `grid` (grid.x per rank x grid.y ranks) fits
// on the device at once, as the blocks of one launch wait on each other; `what` names the launch
// in the error ("the intranode dispatch").
template <typename... Params, typename... Args>
void launch_resident(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                     cudaStream_t stream, bool cooperative, Args&&... args) {
  const int resident = max_resident_blocks(kernel, static_cast<int>(block.x), smem_bytes);
  const long long blocks = static_cast<long long>(grid.x) * grid.y;
  MOE_HOST_CHECK(blocks <= resident, what << " launch needs all of its " << blocks << " blocks (" << grid.x
                                          << " per rank x " << grid.y << " ranks) resident at once, but this GPU holds "
                                          << resident << "; lower num_sms (or the number of simulated ranks)");
  launch_kernel(kernel, grid, block, smem_bytes, stream, cooperative, std::forward<Args>(args)...);
}

}  // namespace moe_dispatch

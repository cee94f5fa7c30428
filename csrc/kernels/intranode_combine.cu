// Intranode combine kernel and its host launcher. Protocol: intranode_roles.cuh.
#include <cuda_runtime.h>

#include "core/error.h"
#include "core/launch.h"
#include "kernels/intranode.h"
#include "kernels/intranode_device.cuh"

namespace moe_dispatch {
namespace intranode {

namespace {

// blockIdx = (2 * channel + is_receiver, launched rank). Senders: W warp groups, one per
// destination (the rows' source rank). Receivers: warp 0 coordinates, the others reduce.
// P, kMinBlocks: the variant (variant.cuh), as for the dispatch kernel.
template <class T, class P, int kMinBlocks>
__global__ void __launch_bounds__(kNumThreads, kMinBlocks) combine_kernel(const __grid_constant__ CombineArgs args) {
  using Ctx = DeviceCtxT<Common, P>;
  const Common& common = args.common;
  launched_rank_block<P>(common, [&](int rank, uint64_t epoch) {
    const int channel = static_cast<int>(blockIdx.x) / 2;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    if (blockIdx.x % 2 == 0) {
      __shared__ GroupState groups[kMaxRanks];
      const int group_warps = kNumWarps / common.num_ranks;
      const int peer = warp / group_warps;
      if (peer < common.num_ranks) {
        Ctx ctx{&common, peer + 1, group_warps * 32};
        combine_send(ctx, args, rank, channel, peer, warp % group_warps, group_warps, epoch, &groups[peer]);
      }
    } else {
      __shared__ CombineRecvState state;
      ring::init_reduce_state(&state);
      Ctx ctx{&common, 0, 32};
      const CombineSource src = combine_source(ctx, args, rank, channel, epoch, warp == 0);
      if (warp == 0) {
        ring::reduce_coordinator(ctx, src, kNumWarps - 1, &state);
      } else {
        ring::reduce_worker<T>(ctx, src, args.slot.x_bytes, warp - 1, kNumWarps - 1, &state);
      }
    }
  });
}

template <class T>
void launch_typed(const CombineArgs& args, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  const dim3 grid(static_cast<unsigned>(2 * c.num_channels), static_cast<unsigned>(c.num_launch_ranks));
  with_intranode_variant(c.variant, [&](auto policy, auto min_blocks) {
    auto kernel = combine_kernel<T, decltype(policy), decltype(min_blocks)::value>;
    const size_t smem = prepare_dynamic_smem(kernel, bulk_smem_bytes<decltype(policy)>());
    launch_resident("the intranode combine", kernel, grid, dim3(kNumThreads), smem, stream, cooperative, args);
  });
}

}  // namespace

void launch_combine(const CombineArgs& args, DType dtype, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  const SlotLayout& s = args.slot;
  check_common(c);
  MOE_HOST_CHECK(s.x_bytes > 0 && s.x_bytes % kFieldAlign == 0,
                 "y rows must be a positive multiple of " << kFieldAlign << " bytes, got " << s.x_bytes);
  const SlotLayout want = make_slot_layout(s.x_bytes, 0, 0);
  MOE_HOST_CHECK(
      want.slot_bytes == s.slot_bytes && want.aux_offset == s.aux_offset && s.num_topk == 0 && s.scale_bytes == 0,
      "the combine slot layout is not make_slot_layout(" << s.x_bytes << ", 0, 0)");
  MOE_HOST_CHECK(s.slot_bytes <= c.layout.slot_bytes,
                 "a combine slot needs " << s.slot_bytes << " bytes but the buffer's slots hold " << c.layout.slot_bytes
                                         << "; make the Buffer for this hidden size and dtype");
  check_combine_ranks(args.ranks, c.num_launch_ranks, c.rank_begin, "is_token_in_rank", "y");
  with_dtype(dtype, [&](auto tag) { launch_typed<decltype(tag)>(args, cooperative, stream); });
}

}  // namespace intranode
}  // namespace moe_dispatch

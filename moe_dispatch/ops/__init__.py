"""The Triton kernels (layout, permute, fp8 quantisation), the one-pass CPU row sums of ``_C``,
and the functions that pick a kernel or its torch reference for a tensor."""

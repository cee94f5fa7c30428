"""The Triton kernels (layout, permute, fp8 quantisation) and the functions that pick a kernel
or its torch reference for a tensor."""

"""The routing op `mhar_route`: a torch reference and fused Triton kernels, with their benchmarks."""

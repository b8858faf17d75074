"""Fused Triton kernels of the routing op (the "triton" and "triton_op" backends of kernels.routing).

Modules, each one job: `tiles` (shared `@triton.jit` helpers), `forward` and `backward` (the
kernels), `launch` (launch tables and the launcher: the one module on Triton internals, and the
tests' seams), `host` (host wrappers: check, allocate, launch), `shared` (shared-source gradients
summed in place), `autograd` (the custom op `route_op` and the eager `route_eager`). Benchmarks
use their public functions, with a `launch.LaunchTables` argument to try other launch shapes.
This package module imports nothing, so that importing one of them loads only what it needs.
"""

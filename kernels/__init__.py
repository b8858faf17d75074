"""The routing op `mhar_route`: a torch reference and fused Triton kernels, with their benchmarks."""

from kernels.routing import BACKENDS, mhar_route, mhar_route_with_weights, route_torch, routing_source

__all__ = ["BACKENDS", "mhar_route", "mhar_route_with_weights", "route_torch", "routing_source"]

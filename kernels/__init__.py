"""The routing op `mhar_route`: a torch reference and fused Triton kernels, one explicit backend argument."""

from kernels.routing import (
    BACKENDS,
    MAX_TRITON_SOURCES,
    mhar_route,
    mhar_route_sites,
    mhar_route_with_logits,
    mhar_route_with_weights,
    resolve_backend,
    route_torch,
    routing_source,
)

__all__ = [
    "BACKENDS",
    "MAX_TRITON_SOURCES",
    "mhar_route",
    "mhar_route_sites",
    "mhar_route_with_logits",
    "mhar_route_with_weights",
    "resolve_backend",
    "route_torch",
    "routing_source",
]

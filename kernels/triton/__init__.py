"""Fused Triton kernels of the routing op (the "triton" and "triton_op" backends of kernels.routing).

What runs, by path (module.function; the kernels, in `forward` and `backward`, launch from `host`):

Eager path (backend "triton", what training runs; autograd.Function, no custom-op dispatch):
- forward: `autograd.route_eager` -> `autograd._Route.forward` -> `host.forward` (a block's sites:
  `route_sites_eager` -> `_RouteSites.forward` -> `host.forward_sites`, the block kernel or
  `host.forward_pair` per pass); marked sources' norms from `shared.GradSlot.source_rstd` ->
  `host.source_rstd`. Without grad the host forward is called directly.
- backward: `autograd._Route.backward` (or `_RouteSites.backward`) -> `host.backward_stats` (or
  `host.backward_stats_pair`, a block's pairs in one launch; the stats kernel, then
  `host.finish_param_grads`) -> `host.backward_mix`,
  or, when every source is shared, `shared.backward_mix_shared` (a `shared.MixGroup` that runs
  `host.backward_mix` once for several calls, launch.MIX["calls"] at most). A shared source's sum is finished by
  `shared._SharedGrad.backward` -> `shared.finish_shared` -> `host.apply_norm_term`.

Custom-op path (backend "triton_op", and what torch.compile traces in place of `route_eager`):
- forward: `autograd.route_op` -> `torch.ops.mhar.route_fwd` (`autograd.route_fwd`) -> `host.forward`.
- backward: `autograd._op_backward` -> `torch.ops.mhar.route_bwd` (`autograd.route_bwd`) ->
  `host.custom_op_backward`, which chains `host.backward_stats` and `host.backward_mix` for one call.

Modules, each one job: `tiles` (shared `@triton.jit` helpers), `forward` and `backward` (the
kernels), `launch` (launch tables and the launcher: the one module on Triton internals, and the
tests' seams), `host` (host wrappers: check, allocate, launch), `shared` (shared-source gradients
summed in place), `autograd` (both paths' autograd). Benchmarks use the host functions, with a
`launch.LaunchTables` argument to try other launch shapes. This package module imports nothing,
so that importing one of them loads only what it needs.
"""

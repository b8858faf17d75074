"""Shared-source gradients: a source many eager routing calls read gathers their gradients in one buffer, in place.

A source marked with `share_source_grad` (kernels.routing.routing_source) has its gradient summed
in place across the eager calls that read it: the mix kernel does not read such a source (its
norm term, a per-row multiple of the source, is summed per row and applied once, when the sum is
complete), and one mix pass serves up to the mix table's "calls" consecutive calls over the same
sources (the sites of a layer), one read and write of each sum for all of them; the source's
1 / rms per row is computed once, for the row kernels of all those calls.

A call finds a source's slot on the tensor `share_source_grad` returned, or on an alias of it that
another autograd function made on the way (FSDP2 hands a module aliases of its inputs): any
tensor with the marked one's data, shape, strides and dtype while the marked tensor is alive.
Such an alias must derive from the marked tensor, so that its calls' backward runs before the
slot's sum is handed on; a gradient arriving later is refused (`check_open`), never dropped.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch

from kernels.triton import host
from kernels.triton.launch import DEFAULT_TABLES, LaunchTables


class GradSlot:
    """What the routing calls that read one source share: its gradient, summed in place
    (`grad` without the norm term, whose per-row coefficient the calls sum in `csum`;
    `pending`, the group of calls whose mix pass has not run yet), and its 1 / rms per row,
    computed by the first call that reads it and again if the source changes."""

    __slots__ = ("grad", "csum", "pending", "rstd", "rstd_key", "tables", "done", "__weakref__")

    def __init__(self) -> None:
        self.done = False  # its sum was handed on: no call may add to it any more
        self.grad: torch.Tensor | None = None
        self.csum: torch.Tensor | None = None
        self.pending: MixGroup | None = None
        self.rstd: torch.Tensor | None = None  # the source's 1 / rms per row, for every call
        self.rstd_key: tuple | None = None  # (eps, the source's version) it was computed for
        self.tables: LaunchTables = DEFAULT_TABLES  # those of the last call that read the source

    def source_rstd(self, source: torch.Tensor, eps: float) -> torch.Tensor:
        key = (eps, source._version)
        if self.rstd_key != key:
            self.rstd, self.rstd_key = host.source_rstd(source, eps, self.tables), key
        return self.rstd


class MixGroup:
    """Backward calls over the same shared sources whose mix waits for the next such call, so
    that one pass over the sources' gradient sums serves up to tables.mix["calls"] of them (the
    two sites of a layer read the same sources): per source, one read and one write of its sum
    for the group instead of one of each per call. It runs when full, when a call over other
    sources needs one of its slots, or when a slot's sum is handed on (finish_shared)."""

    def __init__(
        self, slots: tuple[GradSlot, ...], sources: tuple[torch.Tensor, ...], num_heads: int, tables: LaunchTables
    ) -> None:
        self.slots, self.sources, self.num_heads, self.tables = slots, sources, num_heads, tables
        self.calls: list[host.MixCall] = []
        for slot in slots:
            slot.pending = self

    def flush(self) -> None:
        for slot in self.slots:
            slot.pending = None
        host.backward_mix(self.calls, self.sources, self.slots, self.num_heads, self.tables)
        self.calls = []


def backward_mix_shared(
    call: host.MixCall,
    sources: Sequence[torch.Tensor],
    slots: tuple[GradSlot, ...],
    num_heads: int,
    tables: LaunchTables = DEFAULT_TABLES,
) -> None:
    """A call whose every source is shared joins the pending group over the same sources, or
    starts one. A call that waits for the next keeps copies of its query and norm weight: they
    may be FSDP's gathered parameters, whose memory is freed once their layer's backward is done
    (the sources and the output gradient stay alive: autograd and the slots hold them)."""
    group = slots[0].pending
    if group is None or group.slots != slots or group.num_heads != num_heads or group.tables is not tables:
        for slot in slots:
            if slot.pending is not None:
                slot.pending.flush()
        group = MixGroup(slots, tuple(sources), num_heads, tables)
    if len(group.calls) + 1 >= tables.mix["calls"]:
        group.calls.append(call)
        group.flush()
    else:
        group.calls.append(call._replace(query=call.query.clone(), norm_weight=call.norm_weight.clone()))


def check_open(slots: Sequence[GradSlot | None]) -> None:
    """Refuse a gradient for a slot whose sum was already handed on (it would be lost)."""
    if any(slot is not None and slot.done for slot in slots):
        raise RuntimeError(
            "mhar_route: a routing call's gradient reached a marked source (routing_source) after the source's "
            "gradient sum was handed on: route the tensor routing_source returned (or an alias made of it), "
            "not the original tensor"
        )


def finish_shared(source: torch.Tensor, slot: GradSlot) -> torch.Tensor | None:
    """The complete gradient a slot gathered: its norm term applied, once."""
    if slot.pending is not None:
        slot.pending.flush()
    slot.done = True
    grad, csum, slot.grad, slot.csum = slot.grad, slot.csum, None, None
    if grad is None:
        return None
    host.apply_norm_term(source, grad, csum, slot.tables)
    return grad


class _SharedGrad(torch.autograd.Function):
    """Identity whose backward hands on the gradient its slot gathered (plus any that reached
    it the usual way, from consumers other than the eager routing calls)."""

    @staticmethod
    def forward(ctx, source, slot):
        ctx.source, ctx.slot = source, slot  # the source is alive for its readers' backward anyway
        ctx.set_materialize_grads(False)
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad):
        summed = finish_shared(ctx.source, ctx.slot)
        ctx.source = None
        if summed is None:
            return grad, None
        if grad is not None:
            summed.add_(grad)
        return summed, None


_SLOT_ATTR = "_mhar_grad_slot"
# (device, data pointer, shape, strides, dtype) of each live marked tensor -> [(its weakref, slot)]
_MARKED: dict[tuple, list[tuple[weakref.ref, GradSlot]]] = {}


def _identity(t: torch.Tensor) -> tuple:
    return t.device, t.data_ptr(), t.shape, t.stride(), t.dtype


def _forget(key: tuple, ref: weakref.ref) -> None:
    entries = [e for e in _MARKED.get(key, ()) if e[0] is not ref]
    if entries:
        _MARKED[key] = entries
    else:
        _MARKED.pop(key, None)


def share_source_grad(source: torch.Tensor) -> torch.Tensor:
    """`source`, as a tensor whose gradient the eager triton routing calls that read it add
    into one buffer in place, inside their backward kernel, instead of each returning a new
    tensor for autograd to add (one read and write less per call, and no separate add kernel).
    Apply it once where a source is made; every other consumer sees an ordinary tensor.
    Without grad (validation, evaluation) the mark carries the source's norm only, so that the
    forward kernels compute exactly what they compute with grad (the same norms, from the same
    kernel) and read each source's norm once. Inside a torch.compile graph it is the identity
    (see `_share_source_grad_in_graph`)."""
    if not torch.is_grad_enabled():
        marked = source.view_as(source)
        setattr(marked, _SLOT_ATTR, GradSlot())
        return marked
    if not source.requires_grad:
        return source
    slot = GradSlot()
    shared = _SharedGrad.apply(source, slot)
    setattr(shared, _SLOT_ATTR, slot)
    key = _identity(shared)
    ref = weakref.ref(shared, functools.partial(_forget, key))
    _MARKED.setdefault(key, []).append((ref, slot))
    return shared


@torch.compiler.substitute_in_graph(share_source_grad)
def _share_source_grad_in_graph(source: torch.Tensor) -> torch.Tensor:
    """What torch.compile traces in place of `share_source_grad`: the identity. The custom op,
    which a graph calls instead of the eager path (autograd.py), returns its gradients."""
    return source


def _slot_of(t: torch.Tensor) -> GradSlot | None:
    """The slot of a marked tensor, or of an alias of one (one live marked tensor with its data)."""
    slot = getattr(t, _SLOT_ATTR, None)
    if slot is not None or not t.requires_grad:
        return slot
    live = [slot for ref, slot in _MARKED.get(_identity(t), ()) if ref() is not None and not slot.done]
    return live[0] if len(live) == 1 else None  # none, or ambiguous: autograd sums its gradient


def grad_slots(sources: Sequence[torch.Tensor]) -> tuple[GradSlot | None, ...]:
    """Each source's slot, or None where it has none (or has one already taken in this call)."""
    slots, seen = [], set()
    for s in sources:
        slot = _slot_of(s)
        if slot is not None and id(slot) in seen:
            slot = None  # the same source twice in one call: one kernel cannot add twice in place
        if slot is not None:
            seen.add(id(slot))
        slots.append(slot)
    return tuple(slots)
